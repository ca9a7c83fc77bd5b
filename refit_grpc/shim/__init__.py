"""The shim: serves RefitService next to one engine and drives the engine's local calls."""
