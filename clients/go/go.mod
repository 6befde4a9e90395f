module kunci

go 1.19
