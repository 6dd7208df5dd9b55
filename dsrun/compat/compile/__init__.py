"""Parent of DeepSpeed's ``deepspeed.compile`` paths that dsrun serves from other rooms (docs/architecture.md)."""
