"""Where a run is and who hears about it: the progress record, the eval/save monitor, the
callback interface, the built-in reporters and the non-blocking read of logged values. It
knows nothing of models or data, so every room above can report through it.
"""
