"""Data files shipped with jaxcb: the KV cache's calibration text (`jaxcb.kv_scales`)."""
