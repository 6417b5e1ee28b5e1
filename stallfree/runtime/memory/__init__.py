"""Memory: the request table, the KV slot pools and the prefix cache. Imports nothing else in the runtime."""
