"""The sandbox: the travel world in SQL and the six TravelPlanner tools over it."""
