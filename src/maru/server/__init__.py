"""maru-server: pool owner, region allocator and key registry (metadata only)."""
