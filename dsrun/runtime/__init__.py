"""The training runtime: engine, precision and ZeRO strategies, LR schedules, data loader."""
