"""An engine replica's processes: the SchedulerActor (its engine loop, and its rank at tensor-parallel size 1), the
Ray executor and its step transports' actor ends, the WorkerActors."""
