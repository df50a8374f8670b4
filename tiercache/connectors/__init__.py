"""Adapters that let serving engines use tiercache. They translate calls; caching logic stays
in the core. Each adapter imports its engine lazily, so tiercache never depends on one."""
