"""Typed config (schema) and how params files become it (loader)."""

from finetune.config.loader import config_fingerprint, load_config, validate_raw
from finetune.config.schema import FinetuneConfig

__all__ = ["FinetuneConfig", "config_fingerprint", "load_config", "validate_raw"]
