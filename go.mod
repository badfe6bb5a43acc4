module github.com/leash-go/leash

go 1.26.8

require (
	github.com/RussellLuo/timingwheel v0.0.0-20220218152713-54845bda3108
	github.com/redis/rueidis v1.0.79
	go.uber.org/goleak v1.3.0
)

require golang.org/x/sys v0.47.0 // indirect
