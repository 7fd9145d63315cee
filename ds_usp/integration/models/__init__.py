"""Model adaptation: the attention interface, masks, checks and shape of HF models, hybrid layers, VLMs, vision
towers, diffusion transformers, the safety net."""
