"""Tools around the runtime package: the fault drill, the planner's command line."""
