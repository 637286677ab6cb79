"""Scale-out on Ray: engine replicas behind one front end, and prefill/decode disaggregation.

`deploy.start_deployment` starts the workers (Ray actors running `worker.EngineWorker`) and returns a
`client.RayEngineClient`, which the HTTP front end uses exactly like a local AsyncEngine. Importing
this package does not import Ray; starting a deployment does.
"""
