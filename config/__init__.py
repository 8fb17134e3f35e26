"""The default configuration shipped with vkpool and its loader."""
