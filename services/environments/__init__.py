"""TravelPlanner as an environment of outside RL libraries, over the episode API (services/episodes).

One module per library, each importing its library at the top: nothing in the rest of `services` imports
them, so our core never needs the libraries, and each adapter is an install extra (docs/environments.md).
"""
