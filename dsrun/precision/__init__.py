"""Mixed precision: the fp32 / bf16 / fp16 strategies (:mod:`.strategy`), the one loss scaler
(:mod:`.loss_scaler`, DeepSpeed's ``LossScaler``/``DynamicLossScaler``), the precision section's options
(:mod:`.config`) and torch autocast (:mod:`.torch_autocast`)."""
