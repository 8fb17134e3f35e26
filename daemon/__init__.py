"""The vkpool daemon: ZeroMQ server, protocol, scheduler and client library."""
