"""Adapters that put kvtier inside inference engines (kvtier.integrations.transformers)."""
