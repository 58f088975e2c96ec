"""fctkit.protos — the wire formats shared by server, devices and trainer."""
