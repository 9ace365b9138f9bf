"""The controller: plans steps, runs them on Ray worker groups, measures and logs."""
