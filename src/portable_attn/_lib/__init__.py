"""Private building blocks of portable_attn; nothing here is public API."""
