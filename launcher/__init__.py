"""launcher: Megatron-style sharded training from a few lines of YAML (see README.md)."""
