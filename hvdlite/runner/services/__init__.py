"""The launcher's authenticated services: the driver service (task registration,
routability probes, worker exits) and the task service that runs on every host."""
