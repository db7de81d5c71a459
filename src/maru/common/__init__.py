"""What client and server share: protocol, errors, config parsing, extents, region handles."""
