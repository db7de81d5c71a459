"""The cluster tier behind a pool (`maru-server --cluster mooncake`): values sealed here are
published to a Mooncake Store every node shares, and keys missed here are pulled from it
into this pool, proven, and registered. `tier.ClusterTier` is the server's side;
`sidecar` the process that runs the pool's one Mooncake client (docs/operations.md)."""
