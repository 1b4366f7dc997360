"""A probe or finetune job run as several processes, one per host: `multihost.processes` (the
start over `jax.distributed`, who writes, how a job whose process died ends) and
`multihost.coordinator` (the coordination service, in a small process of its own).

Importing this package loads no JAX: the command line imports it to build its options."""
