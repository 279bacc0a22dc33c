"""The sharding compiler: trace -> rules -> propagate -> partition -> passes -> runtime."""
