"""The cost model: memory per rank, step time, a job's node-hours, and the planner's library."""
