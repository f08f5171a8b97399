"""An engine replica's processes: the SchedulerActor (its engine loop), the Ray executor and its step transports'
actor ends, the WorkerActors."""
