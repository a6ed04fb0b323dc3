"""moed_tray: the desktop tray app, a pure gRPC client of the moed daemon (no engine, no torch)."""
