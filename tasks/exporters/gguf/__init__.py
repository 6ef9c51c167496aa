"""GGUF, llama.cpp's file format: the merged model in the types export.gguf lists, the adapter
alone as a LoRA-GGUF, and an Ollama Modelfile beside them."""
