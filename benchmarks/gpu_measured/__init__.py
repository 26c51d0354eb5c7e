"""How fast is it on a GPU? The measured benchmark and its per-kernel GPU times (needs a GPU)."""
