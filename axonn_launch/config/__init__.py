"""From Hydra's composed config to typed, validated settings."""
