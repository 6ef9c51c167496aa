"""Base layer shared by flows, tasks and engine: typed config, workspace layout, errors.

Imports go one way: flows -> tasks -> engine -> finetune (this package). The CLI
(`finetune.cli`) is an entry point beside the flows and imports tasks lazily.
"""
