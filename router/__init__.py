"""Cache-aware routing across replicas with a global radix tree."""
