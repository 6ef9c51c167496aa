"""Dataset types: what a row is, from the raw file to the metrics (see base.DatasetType).

The stages, the engine's inputs and export ask the type of each source
(`DataConfig.datatype`) and never compare its name. Built-in: completion, text, chat,
classification (finetune.datatypes.registry); a project adds its own as one module.
"""

from finetune.datatypes.base import (CAUSAL_LM, SEQUENCE_CLASSIFICATION, DataContext,
                                     DatasetType, Formatted, ModelTask)
from finetune.datatypes.registry import register_dataset_type

__all__ = ["CAUSAL_LM", "SEQUENCE_CLASSIFICATION", "DataContext", "DatasetType", "Formatted",
           "ModelTask", "register_dataset_type"]
