"""The four worker roles (prefill, relay, main decode, mono) over one shared base."""
