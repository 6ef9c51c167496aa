"""One rank's process: its process group and device (`distributed`), what collectives carry
(`comm`), the job it was handed (`job`), dying with its stage (`lifetime`), a failure as one
line (`failures`), and saving and stopping on a scheduler's signal (`preemption`). The lowest
room: it imports no other part of the engine.
"""
