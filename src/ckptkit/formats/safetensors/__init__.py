"""safetensors: the codec and its one writer (``codec``, torch-free), and its torch half
(``torch``: torch tensors to and from the format, tied tensors kept as aliases)."""
