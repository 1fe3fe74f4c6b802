"""hybridllm forecaster: demand forecasting, capacity planning and a scaling simulator."""
