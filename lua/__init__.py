"""The Redis Lua scripts, shipped inside the wheel as the package `gateway.lua`."""
