"""The Llama model (`llama.py`), its frozen config (`config.py`), and weight loading (`loader.py`)."""
