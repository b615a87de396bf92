"""The engine: the chain and its adjoint, the steps' interface and providers,
the core's bridge, states, ownership, the forward's handshake and the serial path."""
