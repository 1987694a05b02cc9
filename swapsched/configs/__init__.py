"""Data package: hardware profiles, model sizes and PPO settings (YAML)."""
