# Registers logon scheduled tasks for the moed daemon and tray for the current user
# (written by `moed service install`). Run:   powershell -ExecutionPolicy Bypass -File install-moed.ps1
# Remove them:                               powershell -ExecutionPolicy Bypass -File install-moed.ps1 -Uninstall
param([switch]$Uninstall)
$ErrorActionPreference = 'Stop'

$Moed = '@MOED@'
$MoedTray = '@MOED_TRAY@'
$DaemonArguments = '@DAEMON_ARGUMENTS@'
# The daemon's token file ('' = no token). It becomes this user's MOED_TOKEN_FILE, which the daemon, the
# tray and the moed command read the token from: the token itself is never on a command line.
$TokenFile = '@TOKEN_FILE@'
$Tasks = @('moed daemon', 'moed tray')

if ($Uninstall) {
    foreach ($name in $Tasks) {
        if (Get-ScheduledTask -TaskName $name -ErrorAction SilentlyContinue) {
            Stop-ScheduledTask -TaskName $name -ErrorAction SilentlyContinue
            Unregister-ScheduledTask -TaskName $name -Confirm:$false
            Write-Host "removed logon task '$name'"
        }
    }
    if ($TokenFile -and [Environment]::GetEnvironmentVariable('MOED_TOKEN_FILE', 'User') -eq $TokenFile) {
        [Environment]::SetEnvironmentVariable('MOED_TOKEN_FILE', $null, 'User')
        Write-Host "removed the user environment variable MOED_TOKEN_FILE"
    }
    exit 0
}

foreach ($exe in @($Moed, $MoedTray)) {
    if (-not (Test-Path -LiteralPath $exe)) {
        throw "moed executable not found: $exe (reinstall moed, then run 'moed service install' again)"
    }
}

$user = [System.Security.Principal.WindowsIdentity]::GetCurrent().Name
$trigger = New-ScheduledTaskTrigger -AtLogOn -User $user
$principal = New-ScheduledTaskPrincipal -UserId $user -LogonType Interactive -RunLevel Limited
# no time limit; restart the daemon if it fails
$settings = New-ScheduledTaskSettingsSet -AllowStartIfOnBatteries -DontStopIfGoingOnBatteries `
    -ExecutionTimeLimit ([TimeSpan]::Zero) -RestartCount 3 -RestartInterval (New-TimeSpan -Minutes 1)

if ($TokenFile) {
    [Environment]::SetEnvironmentVariable('MOED_TOKEN_FILE', $TokenFile, 'User')
    $env:MOED_TOKEN_FILE = $TokenFile
    Write-Host "MOED_TOKEN_FILE=$TokenFile set for $env:USERNAME (the daemon reads its token from it)"
}

$daemon = New-ScheduledTaskAction -Execute $Moed -Argument $DaemonArguments
Register-ScheduledTask -TaskName 'moed daemon' -Action $daemon -Trigger $trigger -Principal $principal `
    -Settings $settings -Description 'moed: local daemon serving Mixture-of-Experts models' -Force | Out-Null

$tray = New-ScheduledTaskAction -Execute $MoedTray
Register-ScheduledTask -TaskName 'moed tray' -Action $tray -Trigger $trigger -Principal $principal `
    -Settings $settings -Description 'moed tray menu' -Force | Out-Null

Start-ScheduledTask -TaskName 'moed daemon'
Start-ScheduledTask -TaskName 'moed tray'
Write-Host "registered logon tasks 'moed daemon' and 'moed tray' for $user (started now)"
