"""What runs the decoders: the parameter contract, `Decoder` base class, per-generation state,
step result and phase timer, the model runners and their caches (eager, batched, static and
compiled), tree attention, the beam search, and the generate loop."""
