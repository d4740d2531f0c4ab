"""Providers of pods, one module each behind the interface in `base` (registered by name;
a provider's module – and any client library it needs – is imported only when used)."""
