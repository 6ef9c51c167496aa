"""Base layer shared by flows, tasks and engine: typed config, workspace layout, errors,
atomic file writes and `module:name` loading.

Imports go one way: flows -> tasks -> engine -> finetune (this package); the `finetune`
command (flows/cli.py) is on the orchestration side with the flows.
"""
