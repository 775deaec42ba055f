"""Pure placement and sharing decisions, shared by the deployed services and the simulator."""
