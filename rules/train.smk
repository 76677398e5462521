# placeholder: owned by the train-stage engineer
