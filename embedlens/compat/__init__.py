"""Where embedlens leans on another library's private parts, and the switch to its public path."""
