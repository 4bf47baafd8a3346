"""The parallel machinery: rank discovery, process groups, collectives, the
tensor-parallel layers and their GEMMs, attention, initialization, shard geometry."""
