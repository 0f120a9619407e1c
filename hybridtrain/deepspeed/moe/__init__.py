"""``deepspeed.moe``: only the parameter-group helper (hybridtrain has no MoE layers)."""
