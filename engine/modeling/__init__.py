"""The model: loaded (`model`, `construction`), adapted (`adapter`, `vocabulary`, `labels`) and
transformed (`runtime`, `compile`, `cpu_linear`, `quantization`, `pipeline_stages`). It knows
no data layout and no strategy.
"""
