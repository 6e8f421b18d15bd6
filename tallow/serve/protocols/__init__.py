"""Wire protocols: each StreamProtocol (base.py) maps its request body to a RequestPlan and renders
the result; each protocol's pydantic request models sit beside it (*_schemas.py)."""
